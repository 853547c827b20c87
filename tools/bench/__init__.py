"""plait.tools.bench: benchmark scripts that print ratios against a peer in the same run."""
