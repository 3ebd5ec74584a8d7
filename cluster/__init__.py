"""pdserve.cluster"""
