"""pdserve.models"""
