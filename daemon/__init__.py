"""plait.daemon"""
