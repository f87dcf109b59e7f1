#!/usr/bin/env bash
# The GPU checks in one run, for a machine with one CUDA GPU: the device line, the CUDA tests,
# the whole suite (its failures again with their tracebacks), the compiled (CUDA-graph) bench, fine-tuning and circuit extraction on the GPU
# against the CPU, a profile of Single against the fused model, then `hydra-ens bench --device
# cuda` on a MiniLM-L6-sized and a ViT-B/16-sized model (random weights; Single, the deep ensemble
# explicit and fused, the fused LoRA-Ensemble, Hydra with and without a shared trunk; ViT-B in fp32 and fp16,
# its bf16 recorded in docs/benchmarks.md). Every step has its own time limit (560 s in all), so
# a slow step costs only itself; logs and reports go to $OUT.
#
#   OUT=runs/gpu bash benchmarks/gpu_check.sh
#   STEPS="models suite" OUT=runs/gpu bash benchmarks/gpu_check.sh    # only the steps named
#
# Python packages: those of pyproject.toml; where the machine lacks some, put wheels in .whl/
# (installed into /tmp/site) and packages to import as they are in .gpu/site/.
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD/.gpu/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
HYDRA="python3 -c 'import sys; from hydra_cli import main; sys.exit(main())'"
step() {  # step NAME SECONDS COMMAND: run with a limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2; shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
    local start=$SECONDS
    timeout "$limit" bash -c "$*" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - start)) s"
    tail -n "${TAIL:-40}" "$OUT/$name.log"
}

step device 20 "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; \
  python3 -c 'import torch, transformers, onnxruntime; print(torch.__version__, torch.version.cuda, \
  transformers.__version__, onnxruntime.__version__)'; nproc"
step models 40 "python3 - <<'PY'
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, ViTConfig, ViTForImageClassification
from hydra_ensembles.models import default_model_path
torch.manual_seed(0)
source = default_model_path()
config = BertConfig.from_pretrained(source, num_labels=4)
BertForSequenceClassification(config).save_pretrained('/tmp/minilm-l6-random')
AutoTokenizer.from_pretrained(source).save_pretrained('/tmp/minilm-l6-random')
vit = ViTConfig(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, num_labels=10)
ViTForImageClassification(vit).save_pretrained('/tmp/vit-b16-random')
print('saved')
PY"
TAIL=60 step cuda-tests 80 "python3 -m pytest -q -p no:cacheprovider -n 4 -m 'not slow' \
  tests/fusion/test_cuda.py tests/fusion/test_cuda_paths.py tests/experiments/test_bench.py \
  tests/serving/test_transformers.py -k 'cuda or gpu'"
# the whole suite, each test's outcome written as it ends (-v), so a step cut at its limit still
# names its failures (the summary line comes last)
TAIL=25 step suite 150 "python3 -m pytest -v -p no:cacheprovider -n 16 -m 'not slow and not real_model' \
  --timeout 80 --continue-on-collection-errors -rf --tb=line -p no:benchmark > $OUT/suite-tests.log 2>&1; \
  grep -E 'FAILED|ERROR' $OUT/suite-tests.log | sort -u; tail -3 $OUT/suite-tests.log"
# the suite's failures again, each with its traceback (the suite's step may be cut before its summary)
TAIL=150 step failures 60 "grep -oE '(FAILED|ERROR) tests/[^ ]+' $OUT/suite-tests.log | cut -d' ' -f2 | sort -u \
  > $OUT/failed.txt; [ -s $OUT/failed.txt ] || exit 0; python3 -m pytest -q -p no:cacheprovider -n 8 -p no:benchmark \
  --timeout 50 --tb=short \$(cat $OUT/failed.txt | tr '\\n' ' ')"
TAIL=30 step bench-compiled 70 "$HYDRA bench /tmp/minilm-l6-random --device cuda --precision bf16 \
  --batch-sizes 1,64 --test-set 0 --repeats 30 --methods deep-ensemble,hydra,trunk --shared-layers 3 \
  --compile reduce-overhead --out $OUT/bench-compiled"
step training 50 "python3 benchmarks/training_devices.py --model /tmp/minilm-l6-random --devices cuda,cpu \
  --train 160 --budget 4"
step profile 30 "python3 benchmarks/gpu_profile.py --model /tmp/minilm-l6-random --batch 64 --precision bf16; \
  python3 benchmarks/gpu_profile.py --model /tmp/vit-b16-random --batch 64 --precision bf16"
TAIL=70 step bench-minilm 60 "$HYDRA bench /tmp/minilm-l6-random --device cuda --precision fp32,bf16,fp16 \
  --batch-sizes 1,8,64,256 --test-set 0 --repeats 20 --shared-layers 3 \
  --methods deep-ensemble,deep-fused,lora-fused,hydra,trunk --out $OUT/bench-minilm"
TAIL=70 step bench-vit 60 "$HYDRA bench /tmp/vit-b16-random --device cuda --precision fp32,fp16 \
  --batch-sizes 1,8,64,256 --test-set 0 --repeats 5 --shared-layers 6 \
  --methods deep-ensemble,deep-fused,lora-fused,hydra,trunk --out $OUT/bench-vit"
