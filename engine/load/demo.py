"""Where the bundled demo model (INT4 AWQ of tiny-qwen2, produced by `quant-serve quantize`) lives."""
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"
