"""Thin routers: parse the request, call one service inside one transaction, return a protocol model."""
