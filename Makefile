# Two commands do all the set-up on a fresh machine (they create .venv and install what is missing):
#   make book    build the HTML book into _build/html
#   make test    run every test: the book rebuilt from scratch (Sphinx warnings are errors), the
#                grader and library tests, the solution notebooks under nbval, and a browser over
#                every page of the book
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Jupyter Book's executed pages, and Sphinx's record of what it has read: dropping both makes
# every page execute again (dropping the first alone re-executes only the pages whose text changed).
CACHE  := _build/.jupyter_cache _build/.doctrees
# What the pages execute: when any of it changes, cached page outputs are stale.
# The tests run in one process per core (at most 4), a test file at a time in each: a file's
# fixtures (the graded course, a notebook's kernel) are set up once. (A worker more than the cores
# was not faster on 2 cores.)
PYTEST_WORKERS ?= -n auto --maxprocesses 4 --dist loadfile
PAGE_INPUTS := $(shell find dtp grader -name '*.py') $(wildcard solutions/*.ipynb) requirements.txt

.PHONY: book test browser release bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

# Pages are executed through Jupyter Book's cache, so a rebuild with nothing changed takes
# seconds; the cache is dropped whenever the course library, the grader or the solutions change.
_build/.page-inputs: $(PAGE_INPUTS)
	rm -rf $(CACHE)
	mkdir -p _build
	touch $@

book: $(STAMP) _build/.page-inputs
	$(BIN)/jupyter-book build . --warningiserror --keep-going

# The browser tests drive Debian's Chromium; as root, install it when it is missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { test "$$(id -u)" = 0 && \
		{ apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } \
		|| { echo "the browser tests need Chromium: apt-get install chromium (as root)"; exit 1; }

# The book builds (its pages execute one after another, on one core) while the tests that do not
# read it run beside it; the tests of the built book (its numbers, and a browser over every page)
# run once it is there. A failed build fails the target and prints its whole log.
BOOK_TESTS := tests/book/test_book.py tests/book/test_browser.py
PYTEST     := $(BIN)/python -m pytest $(PYTEST_WORKERS)

test: $(STAMP) browser
	rm -rf $(CACHE)    # every page executes again, so its numbers are fresh
	mkdir -p _build
	$(BIN)/python -m grader.release --check
	( $(MAKE) book > _build/book-build.log 2>&1; echo $$? > _build/book-build.status ) & \
	$(PYTEST) tests solutions $(addprefix --ignore=,$(BOOK_TESTS)) --nbval --nbval-sanitize-with \
		tests/nbval_sanitize.cfg --nbval-kernel-startup-timeout 240; tests=$$?; \
	wait; \
	if [ "$$(cat _build/book-build.status)" != 0 ]; then cat _build/book-build.log; echo "the book did not build"; exit 1; fi; \
	tail -n 12 _build/book-build.log; \
	$(PYTEST) $(BOOK_TESTS) || tests=1; exit $$tests

# For authors: re-run the solutions (storing their outputs) and rebuild notebooks/ from them.
release: $(STAMP)
	$(BIN)/python -m grader.release --execute

# Benchmarks of this machine and of the grader; the book's appendix draws its results.
bench: $(STAMP)
	$(BIN)/python bench/collectives.py
	$(BIN)/python bench/grading_speed.py --output book/appendix/grading.json
	$(BIN)/python bench/grading_speed.py --spinners 2 --output book/appendix/grading_loaded.json

clean:
	rm -rf _build
