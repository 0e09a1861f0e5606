"""dflash_worker_v2 replaced by the v2 test bundle."""
PATCHED = "v2"
