"""pdserve.api"""
