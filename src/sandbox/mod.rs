//! A throwaway cluster for tests and `gpushare demo`: in-process API server, fake kubelet,
//! NVML stub. Never for production. Not implemented yet.
