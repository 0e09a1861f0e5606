"""dflash_worker_v2 replaced by the basic test bundle."""
PATCHED = "basic"
