"""Worker pools kept at their target size: the manager (``manager``), its pure decision
(``plan``), its settings (``settings``) and the pool state it republishes to Redis (``store``)."""
