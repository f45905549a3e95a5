"""Process groups and collectives; parallelism is passed explicitly, never read from globals."""
