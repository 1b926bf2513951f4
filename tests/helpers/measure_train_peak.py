"""Peak memory of one real CPU training step, measured, for tests/test_plan.py.

`python measure_train_peak.py MODEL_DIR MICRO_BATCH SEQ [checkpointed]` prints JSON: the rise of the process's
peak resident memory over one `PolicyTrainer.train_step` (optimizer state already created), and
the gradient bytes inside it. glibc is told to serve every allocation above 64 KiB by mmap and to
give freed memory back at once, so resident memory follows the live tensors; the peak is reset
through /proc/self/clear_refs just before the step.
"""
import ctypes
import json
import re
import sys
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(M_MMAP_THRESHOLD, 65536)
libc.mallopt(M_TRIM_THRESHOLD, 65536)

import torch  # noqa: E402  (after mallopt: every allocation follows the settings)

from colorl.config import load_config  # noqa: E402
from colorl.train.policy import PolicyTrainer, TrainBatch  # noqa: E402


def status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def main() -> None:
    model_dir, micro, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    checkpointed = sys.argv[4:] == ["checkpointed"]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config(None, [f"train.max_tokens_per_micro_batch={micro * seq}", "launch.device=cpu",
                             f"train.activation_checkpointing={str(checkpointed).lower()}"], check_paths=False)
    trainer = PolicyTrainer(Path(model_dir), cfg, "cpu")
    trainer.heap = None  # glibc already gives freed memory back at once here; a trim would add re-faults to the rise
    mask = [0.0] * (seq // 4) + [1.0] * (seq - seq // 4)
    sequences = [(torch.randint(3, 250, (seq,)).tolist(), mask, [-1.0] * seq) for _ in range(micro)]
    batch = TrainBatch.from_sequences(sequences, torch.randn(micro))  # one packed micro-batch
    trainer.train_step(batch)  # creates the optimizer state
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    trainer.train_step(batch)
    grads = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    print(json.dumps({"peak_rise": status("VmHWM") - before, "grads": grads}))


if __name__ == "__main__":
    main()
