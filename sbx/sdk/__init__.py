"""sbx.sdk"""
