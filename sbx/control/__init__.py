"""sbx.control"""
