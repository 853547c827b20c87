"""Built-in model families (placeholder until filled)."""
