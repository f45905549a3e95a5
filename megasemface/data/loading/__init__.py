"""Loading: streaming shards into token-budget batches, with exact mid-epoch resume."""
