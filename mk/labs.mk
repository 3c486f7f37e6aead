# The course labs (chapters/NN-topic): see chapters/check_labs.py.
#   make lab CH=03     the lab's tests against the student's chapters/03-*/lab.py
#   make labs-check    every lab's tests pass on the engine's own function and
#                      fail on the untouched skeleton (part of `make test`)
.PHONY: lab labs-check

lab: setup
	@if [ -z "$(CH)" ]; then \
		echo "make lab: which lab? e.g. make lab CH=03. Labs:"; \
		ls -d chapters/[0-9][0-9]-*/ | xargs -n1 basename | sed 's/^/  /'; \
		exit 2; \
	fi
	$(PY) chapters/check_labs.py --run "$(CH)"

labs-check: setup
	$(PY) chapters/check_labs.py

