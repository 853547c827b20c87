"""plait.proto"""
