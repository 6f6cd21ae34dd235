/* The trace file's record format, as record/tracefile.py defines it (its
 * RECORD_MAGIC, RECORD_HEADER, ENCODING_*, the structs' sizes, FLAG_*,
 * MARSHAL_VERSION): the one place this core names them.
 * tests/test_native_format.py holds each against its Python twin. */

#define RECORD_MAGIC 0x524B4F53u
#define RECORD_HEADER_SIZE 24         /* RECORD_HEADER <IIQII */
#define ENCODING_COMPACT_END 1
#define ENCODING_SPAN_START 4
#define ENCODING_KERNEL_SPAN 5
#define ENCODING_ATTRIBUTED_END 6
#define KERNEL_SPAN_SIZE 63 /* <QQQQqQIBBQB */
#define COMPACT_END_SIZE 17 /* <QqB */
#define SPAN_START_SIZE 58  /* <QQQQqQIIBB */
#define FLAG_SAMPLED 1
#define FLAG_REMOTE_PARENT 2
#define FLAG_PARENT_SAMPLED 8
#define FLAG_GRAPH_REPLAY 128
#define MARSHAL_VERSION 4
