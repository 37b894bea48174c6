VENV ?= .venv
PY := $(VENV)/bin/python
AERIE := $(VENV)/bin/aerie
DEMO_DIR ?= .aerie/demo

export RAY_USAGE_STATS_ENABLED := 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export AWS_EC2_METADATA_DISABLED := true

.PHONY: install demo test lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(AERIE) tiny-target --out .aerie/targets/tiny-llama
	$(AERIE) generate --target .aerie/targets/tiny-llama --max-tokens 64 \
		--prompt "def read_config(path):" --prompt "class LRUCache:"

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check aerie pipelines train_jobs serve_apps tests benchmarks

clean:
	rm -rf $(VENV) .aerie
