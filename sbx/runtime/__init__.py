"""sbx.runtime"""
