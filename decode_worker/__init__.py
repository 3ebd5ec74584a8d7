"""pdserve.decode_worker"""
