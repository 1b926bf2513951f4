"""Weight sync from the FSDP2 trainer into the inference engines (the checkpoint engine)."""
from colorl.sync.checkpoint_engine import CheckpointEngine, StagedUpdate, SyncStats, naive_sync
from colorl.sync.name_maps import NameMapError

__all__ = ["CheckpointEngine", "NameMapError", "StagedUpdate", "SyncStats", "naive_sync"]
