"""sbx.cli"""
