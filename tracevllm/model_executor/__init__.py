"""The model: loading (model_loader.py), Llama (models/) and its layers (layers/)."""
