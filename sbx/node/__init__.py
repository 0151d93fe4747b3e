"""sbx.node"""
