"""plait.tools"""
