"""The streaming example: the digits written as shards and streamed by `ddpkit.data.streaming.StreamingDataModule`."""
