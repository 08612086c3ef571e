# The two commands a new user needs (README.md): `make demo` and `make test`.
# Both set up a virtual environment in .venv, install pyinfer into it, and build the kernels.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODELS := models
SRC_GGUF := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
# the default conversion: --outtype auto keeps the file's own Q4_1 projections, which take sparse
# mode input (decode 1.3x the q8_0 conversion's speed on 2 threads, docs/benchmarks.md session 18)
GGUF := $(MODELS)/smollm2-135m-instruct.sparse.gguf
THREADS ?= 2
PROMPT ?= What is the capital of Germany?

.PHONY: install install-run install-test demo test bench clean uninstall

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# editable_mode=compat: the install is a path in a .pth file, so a folder named `pyinfer` beside a
# user's script (a clone, say) cannot shadow the package as an empty namespace package, which it
# does with setuptools' default finder-based editable install ("cannot import name 'LLM'").
# torch==2.13.0 first, the version the project is tested with. Which wheel pip takes is the
# machine's: a pip configured with a wheel mirror (the project's machines) takes its CPU wheel;
# PyPI alone gives Linux x86-64 the CUDA build (several GB of NVIDIA libraries). For the CPU wheel
# from PyTorch's own index: make install TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# The offline stage of pyinfer-convert trains predictors with PyTorch (the `train` extra).
TORCH_PIP_ARGS ?=
install: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install --quiet -e ".[train]" --config-settings editable_mode=compat

# Run-only: pyinfer-run/-chat/-serve/-inspect/-perplexity and `pyinfer-convert --dense`; no PyTorch
# (the offline stage runs sparse mode input with the uniform allocation, and stops with "training
# predictors needs PyTorch" where it would train predictors).
install-run: $(BIN)/python
	$(BIN)/pip install --quiet -e . --config-settings editable_mode=compat

install-test: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install --quiet -e ".[test,train]" --config-settings editable_mode=compat

$(SRC_GGUF):
	PATH=$(BIN):$$PATH tools/fetch_smollm2.sh $(MODELS)

$(GGUF): $(SRC_GGUF) | install
	$(BIN)/pyinfer-convert $(SRC_GGUF) $(GGUF) -t $(THREADS)

demo: install $(GGUF)
	$(BIN)/pyinfer-run $(GGUF) --chat -p "$(PROMPT)" --temp 0 -n 64 -t $(THREADS)

test: install-test $(SRC_GGUF)
	PYINFER_SMOLLM2_GGUF=$(SRC_GGUF) $(BIN)/python -m pytest -q -ra tests

bench: install $(GGUF)
	$(BIN)/python tools/bench.py $(GGUF) --threads 1 2

# clean removes build outputs and rebuilds the kernels in place when the venv exists, so an
# editable install keeps importing; uninstall removes the venv and every build output (models stay).
clean:
	rm -rf build pyinfer/ops/*.so cython/*.c *.egg-info
	if [ -x $(BIN)/python ]; then $(BIN)/pip install --quiet --no-deps -e . --config-settings editable_mode=compat; fi

uninstall:
	rm -rf $(VENV) build pyinfer/ops/*.so cython/*.c *.egg-info
