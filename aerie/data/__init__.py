"""Ray-free logic for the data stages: regeneration of a table, the ingest output and its
manifest, the training-row plan."""
