VENV ?= .venv
PY := $(VENV)/bin/python
AERIE := $(VENV)/bin/aerie
DEMO_DIR ?= .aerie/demo
# The demo's own tiny target: a 1-minute budget (220 steps; ~5 min on 2 AVX2 cores, ~2 min where the
# CPU has native bf16). Benchmarks use the default 5-minute build: aerie tiny-target --out .aerie/targets/tiny-llama
TARGET ?= .aerie/targets/tiny-demo
TARGET_MINUTES ?= 1
REQUESTS ?= 400

export RAY_USAGE_STATS_ENABLED := 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export AWS_EC2_METADATA_DISABLED := true

.PHONY: install demo stop test lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

RAY := $(VENV)/bin/ray
SERVE := $(VENV)/bin/serve
RAY_TEMP ?= /tmp/aerie-ray
DASHBOARD := http://127.0.0.1:8265
ENDPOINT := http://127.0.0.1:8000
RUN := demo
JOB_ID := aerie-$(RUN)-$(shell date +%s)

# The whole pipeline on the embedded default (local Ray with its dashboard, local files, the tiny
# target): build the target, synthesise captured traffic, then `ray job submit` the optimize job
# (ingest with regenerated replies -> EAGLE-3 and P-EAGLE heads -> benchmark DAG -> the winner on
# Ray Serve) and follow it; then one request through the live endpoint. `make stop` ends it all.
demo: install
	$(AERIE) tiny-target --out $(TARGET) --minutes $(TARGET_MINUTES)
	@test -d $(DEMO_DIR)/capture || $(AERIE) traffic --target $(TARGET) --out $(DEMO_DIR)/capture --requests $(REQUESTS)
	@$(RAY) status --address 127.0.0.1:6379 >/dev/null 2>&1 || $(RAY) start --head --node-ip-address 127.0.0.1 \
		--port 6379 --dashboard-host 127.0.0.1 --num-cpus 2 --object-store-memory 1000000000 \
		--metrics-export-port 8080 --temp-dir $(RAY_TEMP) --disable-usage-stats
	$(RAY) job submit --address $(DASHBOARD) --submission-id $(JOB_ID) -- bash -c \
		"cd $(CURDIR) && $(abspath $(PY)) -m pipelines.optimize --config configs/optimize_demo.yaml \
		--name $(RUN) --target $(abspath $(TARGET)) --input $(abspath $(DEMO_DIR))/capture \
		--storage $(abspath $(DEMO_DIR))/runs"
	$(RAY) job status --address $(DASHBOARD) $(JOB_ID)
	@echo
	@echo "report:     $(DEMO_DIR)/runs/$(RUN)/bench/report.md (plots: $(DEMO_DIR)/runs/$(RUN)/bench/*.png)"
	@echo "winner:     $(DEMO_DIR)/runs/$(RUN)/bench/winner.json"
	@echo "dashboard:  $(DASHBOARD)  (Jobs, Serve, Metrics)"
	@echo "endpoint:   curl $(ENDPOINT)/v1/completions -H 'Content-Type: application/json' \\"
	@echo "              -d '{\"model\": \"tiny-llama\", \"prompt\": \"def read_config(path):\", \"max_tokens\": 32}'"
	@echo
	curl -sS $(ENDPOINT)/v1/completions -H 'Content-Type: application/json' \
		-d '{"model": "tiny-llama", "prompt": "def read_config(path):", "max_tokens": 32, "temperature": 0}'
	@echo

# Tear down the demo: the Serve application, then every Ray process started by `make demo`.
stop:
	-$(SERVE) shutdown -y --address $(DASHBOARD) 2>/dev/null
	-$(RAY) stop --force

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check aerie pipelines train_jobs serve_apps tests benchmarks

clean:
	rm -rf $(VENV) .aerie
