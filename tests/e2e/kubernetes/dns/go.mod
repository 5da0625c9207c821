module mflow-e2e/dns

go 1.26
