"""combined"""
