# Two commands do all the set-up on a fresh machine (they create .venv and install what is missing):
#   make book    build the HTML book into _build/html
#   make test    run every test: the book build (Sphinx warnings are errors), the grader and
#                library tests, and the solution notebooks under nbval
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test release bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

book: $(STAMP)
	$(BIN)/jupyter-book build . --warningiserror --keep-going

test: book
	$(BIN)/python -m grader.release --check
	$(BIN)/python -m pytest tests solutions --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg

# For authors: re-run the solutions (storing their outputs) and rebuild notebooks/ from them.
release: $(STAMP)
	$(BIN)/python -m grader.release --execute

bench: $(STAMP)
	$(BIN)/python bench/grading_speed.py

clean:
	rm -rf _build
