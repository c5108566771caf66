/*
 * next_xid(): the next full transaction id to be assigned, read now
 * (ReadNextFullTransactionId). The prototype's cursors need a bound that is
 * read after the window's largest id; SQL has no function that gives it
 * without assigning an xid. The Rust implementation calls the same function.
 */
#include "postgres.h"
#include "fmgr.h"
#include "access/transam.h"
#include "utils/xid8.h"

PG_MODULE_MAGIC;

PG_FUNCTION_INFO_V1(proto_next_xid);

Datum
proto_next_xid(PG_FUNCTION_ARGS)
{
	PG_RETURN_FULLTRANSACTIONID(ReadNextFullTransactionId());
}
