import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))  # the helpers next to the tests (runtime_cases, train_fixtures, trt_fake)
