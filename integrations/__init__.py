"""Adapters that let other trainers report to plait's node daemon (`plait.observe` inside)."""
