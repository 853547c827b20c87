"""DDP (placeholder until filled)."""
