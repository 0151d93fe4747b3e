"""sbx.storage"""
