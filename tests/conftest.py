import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["HF_HUB_OFFLINE"] = "1"  # nothing a test runs may reach the Hugging Face Hub (read when huggingface_hub is imported)
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs 2 workers on 2 cores: one thread each, or they fight for the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch (read when it is imported) and the processes tests start
sys.path.insert(0, str(Path(__file__).parent))  # the helpers next to the tests (runtime_cases, train_fixtures, trt_*)

# The longest files first (measured per file with --durations; docs/results.md gives the suite's time), so that with
# `-n 2 --dist loadfile --no-loadscope-reorder` no long file starts last while the other idles.
SLOW_FIRST = [
    "test_hybrid_runtime.py", "test_export_archs.py", "test_quantize.py", "test_attention_ort.py",
    "test_oracle.py", "test_export_half.py", "test_speed.py", "test_runtime_parity.py", "test_draft_vocab.py",
    "test_zlab_reference.py", "test_train_demo.py",
]


# test_ray last: its 2-node cluster starts many Python processes, which beside two busy workers
# missed Ray's 60 s proxy deadline (seen in a fresh-clone run); at the end the others are
# finishing short files, and its tiny export is cached by then.
LAST = ["test_ray.py"]


def pytest_collection_modifyitems(items):
    rest = len(SLOW_FIRST)  # every other file, between the two lists
    rank = {name: i for i, name in enumerate(SLOW_FIRST)} | {name: rest + 1 + i for i, name in enumerate(LAST)}
    items.sort(key=lambda item: rank.get(item.path.name, rest))  # stable: file and test order kept otherwise
