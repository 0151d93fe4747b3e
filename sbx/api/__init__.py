"""sbx.api"""
