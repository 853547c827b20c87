"""plait.core"""
