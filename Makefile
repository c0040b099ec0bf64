# `make train` and `make test` each create .venv and install the pinned packages on first use.
PYTHON ?= python3
VENV := .venv
DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8
RUN ?= local_synthetic
TEXT_RUN ?= local_text
MOE_RUN ?= local_text_moe
# More overrides for a train target's command, e.g. `make train ARGS="training.steps=200 mesh.d=8 mesh.t=1"`.
ARGS ?=

.PHONY: train train-text train-moe tools test test-fast lint clean compilers maxtext

# The pinned packages, then this project (the `seqax` package, train.py and sample.py) in editable mode.
$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

# The evaluation and plotting tools (requirements-tools.txt: TensorBoard, matplotlib, transformers on torch,
# lm-eval), which a run does not need: about 2 GB (torch is 0.75 of it), a few minutes.
$(VENV)/.installed-tools: $(VENV)/.installed requirements-tools.txt
	@echo "installing the evaluation and plotting tools (requirements-tools.txt) into $(VENV): about 2 GB, a few minutes"
	$(VENV)/bin/pip install -q -r requirements-tools.txt
	touch $@

tools: $(VENV)/.installed-tools

$(VENV)/.installed-dev: $(VENV)/.installed-tools requirements-dev.txt
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

# The GPU and TPU compilers (bench/compile_for.py), in a venv of their own: requirements-compilers.txt says why.
COMPILERS := .venv-compilers
$(COMPILERS)/.installed: requirements.txt requirements-compilers.txt pyproject.toml
	@echo "installing the GPU and TPU compilers (requirements-compilers.txt) into $(COMPILERS): about 2 GB, a minute or two"
	$(PYTHON) -m venv $(COMPILERS)
	$(COMPILERS)/bin/pip install -q -r requirements-compilers.txt
	$(COMPILERS)/bin/pip install -q --no-deps -e .
	touch $@

compilers: $(COMPILERS)/.installed

# MaxText's training step and its newer jax and libtpu (bench/maxtext/), for bench/maxtext_anchor.py: a venv of
# its own on Python >= 3.12, built from Debian's source if this machine has none (bench/maxtext/setup.sh).
.venv-maxtext/.installed: bench/maxtext/requirements.txt bench/maxtext/setup.sh
	bash bench/maxtext/setup.sh

maxtext: .venv-maxtext/.installed

# The datasets need the venv, not a newer one: order-only (after |), so that reinstalling (a pull that changes
# requirements.txt) does not make them stale, which their writers refuse to overwrite.
synthetic_dataset.zarr: | $(VENV)/.installed
	$(VENV)/bin/python -m tools.write_synthetic_dataset --output $@

train: $(VENV)/.installed synthetic_dataset.zarr
	$(DEVICES) $(VENV)/bin/python -m train --config-name=local_test_synthetic +paths.model_name=$(RUN) $(ARGS)

# Real text that exists wherever Python does: the standard library's own source (no tests).
text_dataset.zarr: | $(VENV)/.installed
	$(VENV)/bin/python -m tools.prepare_dataset "$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \
		--suffixes .py --exclude '*/site-packages/*' '*/test/*' '*/tests/*' '*/idle_test/*' --validation-documents 20 --output $@

# A multiple-choice task from the text's validation files (which line comes next?), scored at every evaluation.
text_choices.jsonl: text_dataset.zarr | $(VENV)/.installed
	$(VENV)/bin/python -m tools.make_choice_task --dataset text_dataset.zarr --output $@

train-text: $(VENV)/.installed text_dataset.zarr text_choices.jsonl
	$(DEVICES) $(VENV)/bin/python -m train --config-name=local_test_text +paths.model_name=$(TEXT_RUN) \
		'evaluation.tasks=[text_choices.jsonl]' $(ARGS)

# The text as a mixture of experts (configs/local_test_text_moe.yaml): 8 experts split over mesh.d=4, so it
# needs the 8 simulated devices too.
train-moe: $(VENV)/.installed text_dataset.zarr text_choices.jsonl
	$(DEVICES) $(VENV)/bin/python -m train --config-name=local_test_text_moe +paths.model_name=$(MOE_RUN) \
		'evaluation.tasks=[text_choices.jsonl]' $(ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .

# Tests run in TEST_WORKERS processes (pytest-xdist; docs/performance.md, "Test times", has what two
# gain on 2 cores); TEST_WORKERS=0 runs them all in pytest's own process.
TEST_WORKERS ?= 2

# Everything: lint and every test, the GPU and TPU compiles included (CI runs this). The two venvs install
# side by side (on 2 cores 83 s instead of 112 s one after the other).
test:
	$(MAKE) -j2 lint $(COMPILERS)/.installed
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

# The edit-test loop: lint and the tests not marked slow, in under two minutes on two cores.
test-fast: lint
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow" tests

clean:
	rm -rf $(VENV) $(COMPILERS) .venv-maxtext synthetic_dataset.zarr text_dataset.zarr text_choices.jsonl runs hf_model lm_eval_tasks \
		text_runs.png
