"""The streaming example: the digits written as shards and streamed by `ddpkit.streaming.StreamingDataModule`."""
