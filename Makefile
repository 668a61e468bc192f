# zerotune: `make demo` tunes the bundled example on 2 CPU ranks; `make test` runs the tests.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast clean

setup: $(STAMP)

# torch first, pinned (its CPU build is on this machine): deepspeed asks for an unpinned torch,
# which would otherwise pull gigabytes of CUDA wheels.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray,bench]'
	# DeepSpeed's CPU ops (shm comm, fused Adam) are JIT-built on first use: build them once here, so
	# no experiment spends its time budget compiling (or is killed mid-build, leaving a stale lock)
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.ops.op_builder.cpu import FusedAdamBuilder, ShareMemCommBuilder; \
	    FusedAdamBuilder().load(verbose=False); ShareMemCommBuilder().load(verbose=False)"
	touch $(STAMP)

# 2 CPU ranks with a 2.5 GiB budget each: ZeRO 1-3 with DeepSpeed's default buckets need a
# 2,000,000,000-byte buffer per rank, so memory bounds their micro batch size. The tuning writes
# demo_results/report.html (with the projection of a 10M-sample run at 2.5 per device-hour), results.csv and
# results.json; `zerotune report demo_results` rewrites them.
demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/zerotune tune --num_gpus 2 --device-memory 2.5GiB \
	    --results-dir demo_results --timeout 300 --train-samples 10000000 --cost-per-device-hour 2.5 \
	    examples/train_gpt.py --steps 40 --deepspeed_config examples/ds_config.json

# .ci/slurm_up.sh: a one-node Slurm cluster for tests/e2e/test_slurm.py; .ci/twonode_up.sh: two nodes in network
# namespaces (Slurm, sshd; Ray started by the tests) for tests/e2e/test_twonode.py; .ci/chromium_up.sh: Debian's
# Chromium for tests/unit/test_report.py (it renders report.html headless). As root with apt; else a message, and
# those tests skip, naming why (fail, with ZEROTUNE_REQUIRE_SERVICES=1: .ci/run); the rest of the suite still runs.
# Two workers (pytest-xdist; an e2e test leaves half of the 2 cores idle), the Slurm, two-node and Ray tests on one
# of them (xdist_group "cluster": one cluster each); then, alone, the tests marked serial, whose readings, memory
# or timing a neighbour's load moves. A worker that dies is not replaced (--max-worker-restart=0): its test fails
# and the run ends, where a new worker re-ran it (nine times, in a trial) and once left the controller waiting forever.
test: setup
	bash .ci/slurm_up.sh || echo "slurm_up failed: the Slurm tests skip (fail in CI)"
	bash .ci/twonode_up.sh || echo "twonode_up failed: the two-node tests skip (fail in CI)"
	bash .ci/chromium_up.sh || echo "chromium_up failed: the report's browser test skips (fails in CI)"
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup --max-worker-restart=0 -m "not serial" --durations=25; status=$$?; \
	    OMP_NUM_THREADS=1 $(PY) -m pytest -q -m serial --durations=10 || status=1; exit $$status

test-fast: setup
	$(PY) -m pytest -q -n 2 -m "not e2e"

clean:
	rm -rf $(VENV) demo_results autotuning_results autotuning_exps
