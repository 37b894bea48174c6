"""Ray-free logic for the data stages: ingest's settings, duplicate scan, eval split, filters and
output (manifest, accounting, trust checks); regeneration of a table; the training-row plan."""
