"""protos"""
