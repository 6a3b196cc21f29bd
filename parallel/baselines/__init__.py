"""baselines"""
