# The book (docs/, mkdocs.yml). Included by the Makefile.
#   make docs          build the site strictly into site/ (a moved snippet or src: link fails it)
#   make docs-serve    serve it on http://127.0.0.1:8000 with live reload
#   make docs-assets   re-run the engine and re-record docs/assets/recorded/ (commit the result;
#                      make docs-tuning's charts and facts.tuning.json there are kept, not redone)
#   make docs-check    strict build + the headless-Chromium test of the built site
.PHONY: docs docs-serve docs-assets docs-check setup-browser

MKDOCS := $(VENV)/bin/mkdocs
# Quiet the mkdocs-material end-of-life banner in build logs.
export NO_MKDOCS_2_WARNING := 1

docs: setup
	$(MKDOCS) build --strict

docs-serve: setup
	$(MKDOCS) serve --strict -a 127.0.0.1:8000

docs-assets: setup
	$(PY) docs/record_assets.py

# Debian's chromium drives the browser test; installed once, as root, if missing.
setup-browser:
	@test -x /usr/bin/chromium || { apt-get update -qq && apt-get install -y -qq chromium; }

docs-check: setup setup-browser
	$(PY) docs/check_site.py

