"""dflash_info replaced by the basic test bundle."""
PATCHED = "basic"
