"""Makes `padded_reference` importable by the tests here and by the ranks they spawn (which inherit sys.path)."""
import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
